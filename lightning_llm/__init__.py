"""lightning_llm: PyTorch Lightning components for LLM post-training research.

Where a method's code lives:

- Lightning ``Callback`` subclasses in :mod:`lightning_llm.callbacks`, one file per method.
- ``LightningModule`` subclasses in :mod:`lightning_llm.modules`, one file per method family.
- ``LightningDataModule`` subclasses and their synthetic tasks in :mod:`lightning_llm.datamodules`.
- The non-Lightning building blocks of a method (layers, algorithms, configs) in a feature module or package
  named after it, which imports no Lightning: :mod:`lightning_llm.lora`, :mod:`lightning_llm.sae`,
  :mod:`lightning_llm.quantization`, :mod:`lightning_llm.pruning`, :mod:`lightning_llm.eviction`. Its callbacks
  and modules import it, never the reverse.

What may import what (the layers) is written in the README's layout section and checked by
``tests/architecture/test_import_layers.py``.
"""
