"""On-disk format: manifest schema (versioned; the versions this release reads are
:data:`resurgo.format.manifest.READABLE_VERSIONS`, sealed manifests only), safetensors data files,
checksums, dtype names."""
