"""What is on a root without reading it: page fingerprints, the local tier's sqlite index and scan, lookups."""
