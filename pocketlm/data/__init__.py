"""Data fetched from the package registries: the shared downloader (:mod:`.download`) and the
training and evaluation corpora (:mod:`.corpora`). Torch-free: the runtime layers and the
training package both use it."""
