"""`fxfuse bench`: the kernel benchmark (`kernel`, report files by `kernel_report`), the model
benchmark (`model`, `model_report`) and their shared output (`output`)."""
