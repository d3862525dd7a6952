# moeserve on CPU: `docker build -t moeserve .` then
#   docker run -p 8000:8000 -v /models:/models -v moeserve-cache:/var/cache moeserve /models/Qwen3-30B-A3B --memory-gb 16
# With no model it serves the bundled demo model. The C++ kernels are built on first use for the CPU the container
# runs on (announced in the log, minutes once; a volume on /var/cache keeps them, and a Hugging Face cache there),
# not at image build time: an image built on one machine must not carry code compiled for another's instruction set.
FROM python:3.11-slim

RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

# torch's CPU wheel first, so the package's `torch>=2.5` does not pull the CUDA build (GBs)
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY moeserve ./moeserve
RUN pip install --no-cache-dir . && rm -rf /src

WORKDIR /
ENV XDG_CACHE_HOME=/var/cache
EXPOSE 8000
ENTRYPOINT ["moeserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
