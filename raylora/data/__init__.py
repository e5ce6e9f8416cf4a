"""Data: from a user's files to the model's batches, one small module per concern.

- `sample`: the `Sample` every format is read into.
- `records`: the lazy row readers (Parquet row groups, memory-mapped `save_to_disk` folders, indexed JSON).
- `formats`: detection, `open_rows` / `check_source`, images, and raylora's own Parquet rows; the peers'
  layouts each in a module of their own, on the shared helpers of `rows`:
  `turns` (`messages` and `conversations`: HF, TRL, OpenAI, axolotl, ms-swift, LLaVA, sharegpt),
  `alpaca` (alpaca and ms-swift's query/response), `llamafactory` (its `dataset_info.json`).
- `processor`: the model folder's processor, also without torchvision.
- `video`: video frames decoded (PyAV) and sampled, with the metadata the processor needs.
- `sampler`: the global sampler (which rows a step trains on).
- `labels`: a sample rendered once and tokenised once, labels on the answers and their stop tokens.
- `batches`: decoding rows, padding and stacking micro batches, the stand-in samples (image, video).
- `steps`: one rank's share of a training step (`StepBatches`): its rows read, cut into micro batches,
  counted for the loss, and moved to the device.
- `preflight`: the driver's data checks before Ray starts (processor, template, a sample of the rows).
- `pipeline`: building the steps' batches beside training. (`raylora prepare-data`, a command on Ray
  Data, is `raylora.prepare`.)

Imports flow one way: preflight, steps -> batches -> labels, formats; steps -> sampler; pipeline ->
formats -> records, turns, alpaca, llamafactory -> rows -> sample; formats, labels, processor -> video;
processor, sampler and video stand on their own otherwise (config only, or nothing).
"""
