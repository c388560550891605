"""Extension points: the pluggy hookspecs, the plugin registry, and the contracts of the
pluggable components (structured-output backends, KV connectors)."""
