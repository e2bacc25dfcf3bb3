"""Evaluations run on this machine: the metrics every system is held to, the systems compared, and what the
`eval` command measures."""
