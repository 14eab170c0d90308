"""Plain data shared by the layers: the request, a step's input and output, the engine core's
per-request output and the errors that cross a process boundary. Nothing here imports
anything of tandem's above ``tandem.sampling_params``, so every layer may use it."""
