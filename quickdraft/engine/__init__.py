"""The engine: the only place that knows the order of a decoding step (batch.py); its scheduler
(scheduler.py) decides from numbers alone and imports without the model or the kernels, so this
package's own module exports nothing: import its modules."""
