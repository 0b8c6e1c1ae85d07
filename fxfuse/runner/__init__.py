"""`fxfuse run`: options and their validation (`options`, `errors`; no torch), model construction
(`setup`), the rank launcher (`launch`) and how it starts ranks (`rank_server`), step compilation
(`step_backends`), CUDA-graph replay (`cuda_graph_step`), speculative-verify bookkeeping (`speculative`),
progress lines (`progress`) and the run itself (`run`)."""
