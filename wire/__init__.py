"""The wire contract between the parts: telemetry events and batches, problem+json bodies, closed code sets.

The sidecar produces what ``wire.telemetry`` defines and the control plane
consumes it; neither imports the other. Imports only ``policies`` (whose
validation error codes cross the wire in problem bodies) and pydantic.
"""
