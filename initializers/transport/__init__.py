"""Getting files from a storage URI: parsing and redacting it, the sources it names, retries,
resumable verified downloads, their progress, the S3 client and safe archive extraction."""
