#!/bin/bash
# The late-board measurement of README.md: PYTHONPATH root (a checkout), a label.
# $1: PYTHONPATH root; $2: label. serve, a call of 3000 tokens, a board 5 s after the call
mkdir -p /tmp/e2e; cd /tmp/e2e; source /work/main/.venv/bin/activate
[ -d /tmp/e2e/model ] || PYTHONPATH=/work/main/tests python -c \
  "from conftest import make_tiny_model; make_tiny_model('/tmp/e2e/model', seed=0, looping=True)"
export PYTHONPATH=$1
port=50081
python -m edgespec_cli serve --model /tmp/e2e/model --listen 127.0.0.1:$port --max-context 4096 --threads 1 > ab-serve-$2.log 2>&1 &
sleep 10
cat > ab-client.py <<PY
import time, edgespec
c = edgespec.Client('127.0.0.1:$port')
t0 = time.time()
r = c.generate('Name three rivers.', max_new_tokens=3000)
print('$2', 'tokens', len(r.token_ids), 'board:', r.device_id or 'none', 'drafter_tokens', r.stats.get('drafter_tokens'), 'secs', round(time.time()-t0, 2), 'digest', hash(tuple(r.token_ids)))
PY
python ab-client.py > ab-client-$2.log 2>&1 &
cp=$!
sleep 5
python -m edgespec_cli drafter --cache 127.0.0.1:$port --device-id board-1 --drafter mag --threads 1 > ab-board-$2.log 2>&1 &
wait $cp
cat ab-client-$2.log
pkill -f "device-id board-1"; pkill -f "listen 127.0.0.1:$port"; sleep 3
