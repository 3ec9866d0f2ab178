"""bullet NNUE checkpoints: the checkpoint directory (`.checkpoint`), its saved format
(`.layout`), tagged records (`.records`), network files (`.network`) and models
(`.models`)."""
