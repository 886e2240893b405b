"""A test cluster on one machine: fake hosts as Linux network namespaces on a bridge, with
per-host bandwidth caps (``tc`` TBF) and links that can be cut (``cluster.netns``).

Used by tests and benchmarks; standard library only.  Needs root."""
