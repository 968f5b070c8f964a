"""Moving bytes: staging copies out of tensors, parallel writers and readers with checksums."""
