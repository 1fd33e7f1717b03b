"""specx store."""
