#!/usr/bin/env bash
# On an AWS spot worker node: turn the two-minute spot interruption notice into a Ray drain, so that Ray
# Train announces the coming preemption to every worker (raylora then checkpoints at every step until the
# node goes) and charges the restart to run.max_preemptions, not run.max_failures. AWS tells only the
# instance itself (instance metadata, spot/instance-action); Ray's AWS provider does not drain for it.
# Started in the background by cluster.yaml's worker_start_ray_commands; exits at once on an on-demand
# node, and when another copy already watches this node.
# usage: spot_drain.sh HEAD_IP:6379
set -u
head="$1"
exec 9>/tmp/raylora-spot-drain.lock
flock -n 9 || exit 0
imds=http://169.254.169.254/latest
meta() {  # IMDSv2: a session token first
  local token
  token=$(curl -sf -X PUT "$imds/api/token" -H "X-aws-ec2-metadata-token-ttl-seconds: 60") || return 1
  curl -sf -H "X-aws-ec2-metadata-token: $token" "$imds/meta-data/$1"
}
[ "$(meta instance-life-cycle)" = spot ] || exit 0
node_id=$(~/raylora-env/bin/python -c \
  'import ray; ray.init(address="auto", log_to_driver=False); print(ray.get_runtime_context().get_node_id())')
while true; do
  # 404 until AWS decides to reclaim; then {"action": "terminate", "time": "2026-11-30T05:02:00Z"}
  if action=$(meta spot/instance-action); then
    when=$(date -d "$(echo "$action" | sed -E 's/.*"time" *: *"([^"]+)".*/\1/')" +%s)
    left=$((when - $(date +%s)))
    exec ~/raylora-env/bin/ray drain-node --address "$head" --node-id "$node_id" \
      --reason DRAIN_NODE_REASON_PREEMPTION --reason-message "aws spot interruption: $action" \
      --deadline-remaining-seconds "$((left > 1 ? left : 1))"
  fi
  sleep 5
done
