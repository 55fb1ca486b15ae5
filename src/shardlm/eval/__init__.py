"""Evaluation: `validation` (the validation loss of the training loop) and `harness` (lm-evaluation-harness's
tasks on a shardlm model: `shardlm eval`; needs the [eval] extra, imported only by what uses it)."""
