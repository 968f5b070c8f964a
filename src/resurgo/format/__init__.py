"""On-disk format v1: manifest schema, safetensors data files, checksums, dtype names."""
