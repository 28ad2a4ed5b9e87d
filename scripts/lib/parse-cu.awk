# Parse the verbose CUnit output of libiscsi's iscsi-test-cu (1.19) into one
# line per test:  NAME <TAB> pass|skip|fail <TAB> reason
#
# Why: CUnit has no notion of "skipped"; a libiscsi test that finds a feature
# missing logs "[SKIPPED] <why>" and returns, and CUnit then reports it as
# "passed". We therefore classify each test ourselves:
#   fail  CUnit's verdict is FAILED; or the test logged a "[FAILED]" line
#         (a libiscsi check whose expectation was not met, even where the
#         test then returned without a CUnit assertion, so CUnit says
#         "passed"); or no verdict was printed at all (the tool crashed, hung
#         and was killed, or the output is cut).
#   skip  not a failure, and the test logged "[SKIPPED] <why>".
#   pass  CUnit's verdict is passed and neither "[FAILED]" nor "[SKIPPED]"
#         was logged.
# Messages printed after a test's verdict and before the next test starts
# (e.g. "...passed    [FAILED] ..." from its teardown) belong to that test.
# Exception: tests listed in expected_failed_log (SUITE.TEST, in BEGIN) provoke a helper's
# "[FAILED]" line on purpose and assert the failure with CUnit; for them only
# CUnit's verdict counts. libiscsi 1.19: iSCSIdatasn.iSCSIDataSnInvalid calls
# write10(..., EXPECT_STATUS_GOOD) with a corrupted DataSN and then
# CU_ASSERT_NOT_EQUAL(ret, 0): a target that rejects the write makes the
# helper log "[FAILED] WRITE10 command failed" while the test passes.
# The stricter "[FAILED] means fail" rule reproduces the project's earlier
# tgt measurement (434 passed, 25 failed, 156 skipped of 615).
#
# Input variable LIST (optional): file with the output of `iscsi-test-cu --list`.
# When given, the k-th test in the output is named by the k-th
# FAMILY.SUITE.TEST entry of the list (the tool runs them in list order) if the
# suite and test names agree; tests of the list that never appear in the
# output are reported as "fail  not run (tool stopped early)".
function clean(s) {
    gsub(/\t/, " ", s); gsub(/^[ ]+|[ ]+$/, "", s); return s
}
function flush(   name, st, why) {
    if (cur == "") return
    n++
    name = suite "." cur
    if (LIST != "" && n <= nlist) {
        split(listname[n], p, ".")
        if (p[2] == suite && p[3] == cur) name = listname[n]
        else { name = "?" "." name; mismatch++ }
    }
    if (verdict == "FAILED") { st = "fail"; why = (failmsg != "" ? failmsg : assertmsg) }
    else if (verdict == "")  { st = "fail"; why = "no verdict printed (tool crashed, hung or was killed)" }
    else if (failmsg != "" && !((suite "." cur) in expected_failed_log)) { st = "fail"; why = "CUnit passed it but it logged [FAILED] " failmsg }
    else if (postfail != "" && !((suite "." cur) in expected_failed_log)) { st = "fail"; why = "CUnit passed it but it logged after its verdict [FAILED] " postfail }
    else if (skipmsg != "")  { st = "skip"; why = skipmsg }
    else                     { st = "pass"; why = "" }
    printf "%s\t%s\t%s\n", name, st, clean(why)
    cur = ""
}
function postabsorb(s,   m) {
    if (s ~ /\[FAILED\]/ && postfail == "") { m = s; sub(/.*\[FAILED\][ ]*/, "", m); postfail = clean(m) }
}
function absorb(s,   m) {
    # Collect messages from one chunk of text that belongs to the current test.
    if (s ~ /\[SKIPPED\]/ && skipmsg == "") { m = s; sub(/.*\[SKIPPED\][ ]*/, "", m); skipmsg = clean(m) }
    if (s ~ /\[FAILED\]/ && failmsg == "")  { m = s; sub(/.*\[FAILED\][ ]*/, "", m);  failmsg = clean(m) }
}
BEGIN {
    nexp = split("iSCSIdatasn.iSCSIDataSnInvalid", exp_list, " ")
    for (k = 1; k <= nexp; k++) expected_failed_log[exp_list[k]] = 1
    nlist = 0
    if (LIST != "") {
        while ((getline l < LIST) > 0) {
            if (split(l, q, ".") == 3) listname[++nlist] = l
        }
        close(LIST)
    }
}
/^Suite: / { flush(); suite = clean(substr($0, 8)); next }
/^Run Summary:/ { flush(); summary = 1; next }
/^  Test: / {
    flush()
    line = substr($0, 9)
    i = index(line, " ...")
    if (i == 0) { cur = clean(line); rest = "" } else { cur = substr(line, 1, i - 1); rest = substr(line, i + 4) }
    verdict = ""; skipmsg = ""; failmsg = ""; assertmsg = ""; postfail = ""
    if (rest ~ /^passed/ || rest ~ /^FAILED/) {
        verdict = substr(rest, 1, 6); post = clean(substr(rest, 7))
        postabsorb(post)
    } else absorb(rest)
    next
}
cur != "" && summary == 0 {
    if ($0 == "passed" || $0 == "FAILED") { if (verdict == "") verdict = $0; next }
    if ($0 ~ /^passed[ ]/ || $0 ~ /^FAILED[ ]/) {
        if (verdict == "") verdict = substr($0, 1, 6)
        postabsorb(substr($0, 7))
        next
    }
    if (verdict != "") {
        if ($0 ~ /^    [0-9]+\. / && assertmsg == "") { assertmsg = clean($0) ; next }
        postabsorb($0)
        next
    }
    absorb($0)
}
END {
    flush()
    if (LIST != "") for (k = n + 1; k <= nlist; k++) printf "%s\tfail\tnot run (tool stopped early)\n", listname[k]
    if (mismatch > 0) printf "parse-cu: %d test names did not match the --list order\n", mismatch > "/dev/stderr"
}
