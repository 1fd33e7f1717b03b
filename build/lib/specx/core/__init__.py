"""specx core."""
