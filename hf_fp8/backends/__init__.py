"""FP8 backends: the interface (:mod:`.base`), one file per backend (:mod:`.native`, :mod:`.te`), and
the registry that chooses among them and walks their FP8 layers (:mod:`.registry`)."""
