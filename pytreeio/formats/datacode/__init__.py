"""DataCode ``.nn`` model files (`.nn`) and their training records (`.training`)."""
