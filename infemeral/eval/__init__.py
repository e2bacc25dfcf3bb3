"""Offline evaluations of the plain (unsplit) model, e.g. perplexity under the sliding window."""
