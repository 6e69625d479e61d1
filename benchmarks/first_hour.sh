#!/usr/bin/env bash
# A newcomer's first hour, timed: a fresh clone with an empty HOME (setup, .venv size, cold and warm start to
# the Ready line, the README's curl and bench examples, make test-fast). Needs port 8000 free. R=, H= pick the folders.
set -u
SRC=$(git -C "$(dirname "$0")" rev-parse --show-toplevel); R=${R:-/tmp/first_hour_clone}; H=${H:-/tmp/first_hour_home}; rm -rf $R $H; mkdir -p $H
git clone -q "$SRC" $R; cd $R
export HOME=$H PIP_DISABLE_PIP_VERSION_CHECK=1
echo "== uptime"; uptime
t0=$(date +%s.%N); make setup > setup.log 2>&1; rc=$?; t1=$(date +%s.%N)
echo "setup rc=$rc $(echo "$t1-$t0"|bc) s"; tail -8 setup.log; du -sh .venv
for run in cold warm; do
  t0=$(date +%s.%N)
  make run > run_$run.log 2>&1 & P=$!
  until grep -q "Ready in" run_$run.log 2>/dev/null; do sleep 0.5; if ! kill -0 $P 2>/dev/null; then echo died; tail run_$run.log; break; fi; done
  t1=$(date +%s.%N); echo "$run start to Ready: $(echo "$t1-$t0"|bc) s"; grep "Ready in" run_$run.log
  if [ $run = warm ]; then
    t0=$(date +%s.%N)
    curl -s localhost:8000/v1/chat/completions -H 'content-type: application/json' \
      -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "What is the capital of France? Answer in one short sentence."}]}'; echo
    t1=$(date +%s.%N); echo "curl $(echo "$t1-$t0"|bc) s"
    .venv/bin/vllm-neuron bench serve --base-url http://127.0.0.1:8000 --dataset-name random \
      --random-input-len 256 --random-output-len 128 --num-prompts 16 --max-concurrency 4 2>&1 | tail -30
  fi
  pkill -INT -f "vllm-neuron serve" ; wait $P; sleep 2
done
t0=$(date +%s.%N); make test-fast > tf.log 2>&1; echo "test-fast rc=$? $(echo "$(date +%s.%N)-$t0"|bc) s"; tail -3 tf.log
