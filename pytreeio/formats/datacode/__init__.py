"""DataCode ``.nn`` model files (:mod:`.nn`) and their training records (:mod:`.training`)."""
