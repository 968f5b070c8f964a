"""On-disk format (version 2; version 1 still read): manifest schema, safetensors data files, checksums, dtype names."""
