# One sessioncache node. CPU build of torch only: the image never pulls CUDA wheels; a GPU
# deployment builds FROM a CUDA base image and installs the matching torch instead.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
COPY pyproject.toml README.md ./
COPY sessioncache ./sessioncache
COPY tiers ./tiers
COPY api ./api
COPY migrations ./migrations
RUN pip install .

ENV SESSIONCACHE_DATA_DIR=/data SESSIONCACHE_HOST=0.0.0.0 SESSIONCACHE_PORT=8080
# memcpy of 2 MiB blocks into the tiers with non-temporal stores (glibc's default threshold is
# ~19 MiB): 1.6-1.8x faster on the reference machine (docs/benchmarks.md). `sessioncache serve`
# sets it itself when GLIBC_TUNABLES is unset; set GLIBC_TUNABLES= (empty) to keep the default.
ENV GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=0x100000
VOLUME ["/data"]
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz')"
CMD ["sessioncache", "serve"]
