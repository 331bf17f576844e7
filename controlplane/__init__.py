"""The control plane: a FastAPI service over SQL that keeps policies, rolls them out and distributes signed bundles."""
