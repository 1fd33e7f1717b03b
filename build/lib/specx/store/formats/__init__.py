"""specx store/formats."""
