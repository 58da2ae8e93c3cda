"""The driver: workers out (in this process or torchrun's engine), one result or one error back;
where the job's stores listen; resumable sweeps.
"""
