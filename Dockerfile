# abada-agent-worker container image: a build stage that compiles the one binary, and a small,
# non-root final stage that only runs it. The binary is the production build: without the cargo
# feature `devkit` (no demo crate, no engine emulator, no JWT validator, no MCP tool server).
#
#   docker build -t abada-agent-worker .                          # `dist` build (the default)
#   docker build --build-arg PROFILE=dev -t abada-agent-worker .  # debug build, faster to compile
#
# No Docker engine runs on the project's development and CI machines. `.ci/dockerfile-check`
# therefore reads THIS FILE and runs the build stage's commands as a shell script in a scratch
# copy of the repository, then checks the binary against what the final stage expects. Keep the
# file within the rule below, or that check fails and says which line broke it.
#
# Parsing rule (what .ci/dockerfile-check understands):
#   - The build stage is every line from `FROM ... AS build` to the next `FROM`; the final stage
#     is the last `FROM` to the end of the file.
#   - A line ending in `\` continues on the next line; a line whose first non-blank character
#     is `#` is a comment.
#   - The build stage uses only ARG, ENV, WORKDIR, COPY and RUN:
#       ARG NAME=default   one per line; the check takes `--build-arg NAME=VALUE` like docker.
#       ENV NAME=value     one pair per line; exported to the following RUN commands, so the
#                          value must make sense on a plain Linux host too (no image paths).
#       WORKDIR /abs/path  mapped to a directory inside the check's scratch root.
#       COPY src... dest   sources are files or directories of the build context (the
#                          repository's tracked files); no --from or --chown in this stage.
#       RUN command        shell form only, run with `sh -c` in the WORKDIR. Use paths relative
#                          to the WORKDIR and `${CARGO_TARGET_DIR:-target}` for cargo's output
#                          (the check may point CARGO_TARGET_DIR at an existing target dir), and
#                          never write outside the WORKDIR: on the host there is no image to
#                          protect it.
#   - The final stage takes the binary with `COPY --from=build <WORKDIR>/<path> <dest>`, sets a
#     numeric non-root USER, EXPOSEs the admin port and has an exec-form ENTRYPOINT naming <dest>.

# --- build stage ---------------------------------------------------------------------------------
# The official Rust image at the project's toolchain (Rust 1.95, see rust-version and the CI
# toolchain), on Debian 12 "bookworm": the same glibc (2.36) as the distroless cc-debian12 runtime
# below, so the binary never asks for a newer glibc symbol than the final image has. A concrete
# version tag rather than `1`/`latest`, so a rebuild is the same toolchain; pin the digest too
# (`rust:1.95.0-slim-bookworm@sha256:...`) in a registry that mirrors images.
FROM rust:1.95.0-slim-bookworm AS build

# `dist` (default) for images that ship: the release profile with whole-program (fat) LTO and one
# codegen unit (Cargo.toml); `dev` compiles faster and is what CI's check uses.
ARG PROFILE=dist

# No incremental compilation: a container build starts from nothing every time the layer is
# invalidated, so incremental state is pure overhead (release has it off already).
ENV CARGO_INCREMENTAL=0
ENV CARGO_TERM_COLOR=never

WORKDIR /build

# Nothing to install: the slim Rust image ships gcc and libc6-dev, and that is all the native part
# of the dependency tree needs. The only C code is aws-lc-sys (rustls' crypto through aws-lc-rs):
# on x86_64 and aarch64 Linux (gnu) it ships pregenerated bindings and builds with its `cc`
# builder, so no cmake, clang/bindgen, perl, nasm or Go. No OpenSSL anywhere (no native-tls), so no
# libssl-dev or pkg-config either. This line fails early, with a clear message, if the image ever
# stops shipping a C compiler.
RUN cc --version && cargo --version

# Dependencies first, in their own layer: build them against an empty crate, so a change to src/
# rebuilds only this crate, not its ~250 dependencies (most of a build's time). --locked: the
# image is built from exactly the committed Cargo.lock, or not at all. --no-default-features:
# the production build, without the devkit. The workspace's other members (devkit/, demo/,
# sim/, proofs/) are only loaded, never compiled (nothing the binary needs depends on them):
# cargo needs each manifest and a target, so their stubs stay, and their sources never enter the
# image's build.
# If Cargo.toml ever names explicit [[bin]]/[[test]]/[[bench]]/[[example]] paths, stub those
# files here too (cargo checks that they exist when it reads the manifest).
COPY Cargo.toml Cargo.lock ./
COPY devkit/Cargo.toml devkit/
COPY demo/Cargo.toml demo/
COPY sim/Cargo.toml sim/
COPY proofs/Cargo.toml proofs/
RUN mkdir -p src devkit/src demo/src sim/src proofs/src \
 && echo 'fn main() {}' > src/main.rs \
 && : > src/lib.rs \
 && : > devkit/src/lib.rs \
 && : > demo/src/lib.rs \
 && : > sim/src/lib.rs \
 && : > proofs/src/lib.rs \
 && cargo build --profile "$PROFILE" --locked --no-default-features \
 && rm -rf src

# The real sources. COPY keeps the files' modification times, which can be older than the stub
# build above; touching the crate roots makes cargo rebuild the crate instead of trusting the
# stub's fingerprint. Only src/ and migrations/ (the run store's SQL, embedded at compile time)
# are needed: tests, scripts and docs stay out of the image.
# The binary is copied to out/ so the final stage finds it at one path whatever the profile
# (cargo writes the `dev` profile to target/debug, every other profile to target/<profile>).
COPY src ./src
COPY migrations ./migrations
RUN touch src/main.rs src/lib.rs \
 && cargo build --profile "$PROFILE" --locked --no-default-features \
 && mkdir -p out \
 && if [ "$PROFILE" = dev ]; then dir=debug; else dir="$PROFILE"; fi \
 && cp "${CARGO_TARGET_DIR:-target}/$dir/abada-agent-worker" out/abada-agent-worker

# --- final stage ---------------------------------------------------------------------------------
# Distroless "cc" for Debian 12: glibc, libgcc_s (Rust's unwinder), CA certificates
# (/etc/ssl/certs, which rustls' platform verifier reads), tzdata and a `nonroot` user (65532);
# no shell, no package manager, about 25 MB. The binary is a dynamically linked glibc program
# (libc, libm, libgcc_s and the loader only; .ci/dockerfile-check verifies the list), so the
# smaller `static` image would not run it. The `:nonroot` variant already runs as 65532.
FROM gcr.io/distroless/cc-debian12:nonroot

LABEL org.opencontainers.image.title="abada-agent-worker" \
      org.opencontainers.image.description="Runs the agent nodes of Abada BPMN processes" \
      org.opencontainers.image.licenses="Apache-2.0"

COPY --from=build /build/out/abada-agent-worker /usr/local/bin/abada-agent-worker

# Numeric, so Kubernetes' `runAsNonRoot: true` can verify it (a user *name* cannot be checked).
USER 65532:65532

# /healthz, /readyz and /metrics (ABADA_AGENT_HTTP_ADDR, default 127.0.0.1:9464: set 0.0.0.0:9464
# to reach them from outside the container, as config/deployment.yaml does). No HEALTHCHECK:
# Kubernetes probes those endpoints itself, and the image has no shell or curl to run one with.
EXPOSE 9464

# Exec form: the worker is PID 1 and receives SIGTERM itself (first signal drains, a second one
# exits at once). It reaps no children because it starts none.
ENTRYPOINT ["/usr/local/bin/abada-agent-worker"]
