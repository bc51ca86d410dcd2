#!/bin/sh
# selftest: a test binary for tests/lanes.sh's cases, copied as "busy" and
# "alone". It marks itself running in $SELFTEST_LANES_DIR for half a second
# and looks three times for another test's mark meanwhile: "busy" (a lane's
# test) passes either way; "alone" (named in the lanes' -a list) fails where
# it saw one, so a lanes.sh that runs it beside a lane is caught.
d=${SELFTEST_LANES_DIR:?the folder of the marks}
me=$(basename "$0")
mark="$d/$me.$$"
: >"$mark"
others() { ls "$d" | grep -vcxF "$me.$$"; }
seen=0
for look in 1 2 3; do
    n=$(others); seen=$((seen + n))
    [ "$look" = 3 ] || sleep 0.25
done
rm -f "$mark"
if [ "$me" = alone ] && [ "$seen" -gt 0 ]; then
    echo "FAIL st_alone: another test ran beside it ($seen sightings)"
    echo "st_$me: 0 passed, 1 failed"; exit 1
fi
echo "st_$me: 1 passed, 0 failed"
