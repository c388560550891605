"""The image side of vision-language models: towers, connectors, image processing, the
families' descriptions (``spec.py``), and the encoder's output cache."""
