"""Deployments of the server beyond one process: ``asyncengine.deploy.ray`` (replicas on Ray
Serve, with prefix-affinity routing and autoscaling on the engine's waiting queue). See
docs/deploy.md."""
