"""Modeling code that ``save_pretrained`` copies into an exported folder for the models no transformers
family computes (Pangu-style: sandwich norm, MLA with any norm eps, MTP modules kept). transformers loads
them with ``trust_remote_code=True``, as it does the code of released Pangu checkpoints.

These modules import transformers, which moetrain itself does not need: moetrain never imports them; it
only copies the files (``moetrain.hf.save``).
"""
