"""On-disk format (version 2, sealed manifests only): manifest schema, safetensors data files, checksums, dtype names."""
