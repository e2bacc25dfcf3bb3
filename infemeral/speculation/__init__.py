"""Speculative decoding: where drafts come from, which of them to keep, and how many to send per step.

The SDK's turn loop calls it once per decode step (`Speculator`); nothing here knows the SDK.
"""
