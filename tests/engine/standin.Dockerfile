# The engine tier's stand-in for the official vLLM image: a Debian rootfs (docker-imported, no
# registry) whose `vllm` command is the faithful stand-in server. Our real Dockerfile is then
# built FROM this, exactly as it is built FROM vllm/vllm-openai on a Spark.
ARG BASE=flash-test-base:bookworm
FROM ${BASE}
COPY server.py /opt/standin/server.py
# as in the vLLM images (vLLM dependencies): the pd router's HTTP stack and prometheus_client
COPY site/ /usr/lib/python3/dist-packages/
RUN printf '#!/bin/sh\nexec python3 /opt/standin/server.py "$@"\n' >/usr/local/bin/vllm && chmod 755 /usr/local/bin/vllm
LABEL org.flash.test=standin-base
