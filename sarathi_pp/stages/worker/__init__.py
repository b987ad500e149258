"""The stage process and its compute, as vLLM names them: a worker (``pipeline_stage.py``'s
``PipelineStage``, the process: transport, token ring, fault injection, the stage loop)
owns a model runner (``model_runner.py``'s ``ModelRunner``: a micro-batch -> metadata ->
model -> sampler). The worker keeps the name ``PipelineStage``: it is the Ray actor's name
that users see in Ray's dashboard and logs."""
