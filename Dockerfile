# flash image for the catalogue's current base (flash_common.releases); every release whose
# `dockerfile` capability names this file builds from it too, with --build-arg FLASH_VLLM_BASE=vX.Y
# --build-arg BASE_IMAGE=<its image> (`flash setup` passes both).
# Our plugin is copied in and registered as a vLLM general plugin; nothing of vLLM is rewritten:
# every patch is applied at runtime by flash_vllm.register() in each vLLM process.
# The base is pinned by tag (no release digest is known to us); `flash setup` records the digest
# it built from. Builds with the classic builder and BuildKit alike, with no network access.
# Generated values: BASE_IMAGE, FLASH_VLLM_BASE (from the release catalogue) and PATCHSET are kept
# in sync by tools/gen_patches_doc.py (--check in the unit tier).
ARG BASE_IMAGE=vllm/vllm-openai:v0.33.0
ARG SELFCHECK=1

# The selfcheck label is chosen by stage name (a label cannot be conditional). An image labelled
# "passed" exists only if the self-check step below succeeded.
FROM ${BASE_IMAGE} AS selfcheck-1
LABEL org.flash.selfcheck=passed
FROM ${BASE_IMAGE} AS selfcheck-0
LABEL org.flash.selfcheck=skipped

FROM selfcheck-${SELFCHECK}
ARG FLASH_VLLM_BASE=v0.33
ARG SELFCHECK=1
ARG PATCHSET=c2ca8d88d6b37eaa
ENV FLASH_VLLM_BASE=${FLASH_VLLM_BASE}
LABEL qwen38.base=${FLASH_VLLM_BASE} \
      org.flash.base=${FLASH_VLLM_BASE} \
      org.flash.patchset=${PATCHSET}

# Our distribution, --no-deps by construction: flash_vllm and the shared flash_common (release
# catalogue, safetensors header reader, effort map), on the image's own Python.
COPY pyproject.toml /opt/flash/pyproject.toml
COPY src/flash_common /opt/flash/lib/flash_common
COPY src/flash_vllm /opt/flash/lib/flash_vllm
RUN python3 /opt/flash/lib/flash_vllm/_image_install.py /opt/flash \
 && python3 -m flash_vllm.selfcheck --expect-patchset "${PATCHSET}" --patchset-only

# Last step: every patch meant for this base must still fit the installed vLLM, or the build fails.
RUN if [ "${SELFCHECK}" = "1" ]; then python3 -m flash_vllm.selfcheck; \
    else echo "flash_vllm selfcheck skipped (SELFCHECK=${SELFCHECK})"; fi
