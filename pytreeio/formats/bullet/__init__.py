"""bullet NNUE checkpoints: the checkpoint directory (:mod:`.checkpoint`), its saved format
(:mod:`.layout`), tagged records (:mod:`.records`), network files (:mod:`.network`) and models
(:mod:`.models`)."""
