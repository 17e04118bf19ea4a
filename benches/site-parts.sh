# Sourced by benches/site.sh and benches/redis-down.sh: the broker and the
# Redis of a site on this machine, in directory $D, on ports from $1.
# Sets MP (mosquitto's port), RP (Redis's), MOSQ and RED (their pids), and
# exports the site key every node signs its shared answers with
# (cache.redis.key_file: 32 random bytes in hex; white space is ignored).
start_broker_and_redis() {
  MP=$(($1 + RANDOM % 1000)); RP=$((MP + 1000))
  od -An -tx1 -N32 /dev/urandom > $D/redis.key
  export EDGEINFER_CACHE__REDIS__KEY_FILE=$D/redis.key
  cat > $D/m.conf <<C
listener $MP 127.0.0.1
allow_anonymous true
set_tcp_nodelay true
max_queued_messages 100000
C
  mosquitto -c $D/m.conf > $D/mosq.log 2>&1 & MOSQ=$!
  redis-server --port $RP --bind 127.0.0.1 --save "" --appendonly no --dir $D > $D/redis.log 2>&1 & RED=$!
  sleep 0.5
}
