"""What a dataset holds: its files read row by row, its schemas, its splits and its images."""
