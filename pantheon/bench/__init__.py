"""Benchmarks: `pantheon bench engine` (in-process, `engine`) and `pantheon bench serve` (`serve`)."""
