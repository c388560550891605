"""A step's data: the persistent batch of rows (``input_batch.py``), what ``prepare`` hands the
device (``inputs.py``: ``StepInputs``, the grammar bitmask's slot) and what comes back
(``output.py``: the pending output a CUDA step becomes once its event fires)."""
