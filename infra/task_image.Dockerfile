# The task image: the lab's training image plus the user's task package (`taskPackage`).
# The build context is the package itself; this file stays in the project (`az acr build
# --file` reads it from the working directory and adds it to the uploaded context as
# `<uuid>_task_image.Dockerfile`, azure-cli's acr `build.py` and `_archive_utils.py`, so the COPY
# below also puts that one file in /app; `docker build --file` takes a Dockerfile outside the
# context too), so the package needs no Dockerfile of its own and its `.dockerignore` applies
# (az reads `task_image.Dockerfile.dockerignore` instead if the package has one, and always
# leaves out a top-level `.git` and `.gitignore`).
# BASE_IMAGE is the training image by its content tag, in the same registry: ACR Tasks pulls
# from the registry it runs in ("Automate container image builds when a base image is updated",
# Azure docs: `ARG REGISTRY_NAME` then `FROM ${REGISTRY_NAME}/...`).
ARG BASE_IMAGE
FROM ${BASE_IMAGE}

# pip writes site-packages, which belong to root; the image runs as 10001 again below.
USER root
# The package's files land on the import path (WORKDIR /app): `mytask/` imports as `mytask`.
COPY . /app/
# Its requirements, if any, with every package of the lab's image held at its version: a pin
# that would replace torch (and its CUDA build) fails this build instead of the first GPU pod.
RUN if [ -f /app/requirements.txt ]; then \
      python -m pip list --format=freeze > /tmp/lab-image.txt \
      && python -m pip install -r /app/requirements.txt -c /tmp/lab-image.txt \
      && rm /tmp/lab-image.txt; \
    fi
USER 10001:10001
