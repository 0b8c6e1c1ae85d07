"""`fxfuse bench`: the kernel benchmark (`kernel`, report files by `kernel_report`), the model
benchmark (`model`, `model_report`), their options (`arguments`, no torch) and shared output (`output`)."""
