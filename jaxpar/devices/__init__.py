"""The devices a job runs on: real GPU / TPU compile targets without the hardware (``targets``) and
the many-host start-up (``distributed``)."""
