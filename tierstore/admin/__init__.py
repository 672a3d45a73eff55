"""Operating a cache directory: fsck and its readers, inventory (stats, ls), gc, the CLI."""
