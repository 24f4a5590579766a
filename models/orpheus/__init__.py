"""Orpheus TTS (canopylabs/orpheus-3b-0.1-ft): a Llama-3.2-3B that writes SNAC 24 kHz codes.

Building blocks that need no mesh:
  tokens           prompt format, special token ids, custom token <-> SNAC code mapping
  snac             our SNAC 24 kHz decoder (codes -> waveform); snac_config, snac_weights: its
                   config.json and the `snac` package's pytorch_model.bin layout
  streaming        the official sliding-window decode (4 frames in, 1 frame out)
  checkpoint       resolve/validate local checkpoints (never downloads)
  demo_checkpoint  writes a tiny random Orpheus + SNAC checkpoint (demo_tokenizer: official ids)

Submodules are imported explicitly; importing this package pulls in nothing.
"""
