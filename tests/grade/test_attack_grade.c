/* test_attack_grade.c - `tandem grade` on a hostile class (issue 39, item 4):
 *   - a submission that is a symbolic link to a secret is recorded as
 *     skipped, and the secret never leaves the machine;
 *   - a folder submission holding links (to a file, to a folder) lists them
 *     as skipped and sends only its regular files;
 *   - an output folder holding a planted link (feedback/ pointing elsewhere,
 *     a record name pointing at a file) is refused before anything is
 *     written, and the link's target is left untouched.
 * What grade sends goes to a real listening socket in this test, which
 * keeps every byte it receives and answers 500: the bytes are then searched
 * for the secret and for the regular file's text (so the capture is known to
 * have seen the request). */
#include "proc.h"

#include <sys/stat.h>

#define TA_DIR "build/test_attack_grade.d"
#define TA_SECRET "TOPSECRET-ssh-key-5f1d"

/* ==== Capturing listener ==== */

/* A child that accepts connections on fd, appends everything it reads to
 * path and answers each request 500 (grade then records a failure), except
 * grade's preflight (grade_check.c): GET /v1/models lists models a and b,
 * and its one-token "Reply with OK." chats get 200. */
static pid_t ta_capture(int lfd, const char *path) {
    pid_t pid = fork();
    if (pid != 0) return pid;
    FILE *f = fopen(path, "wb");
    for (;;) {
        int c = accept(lfd, NULL, NULL);
        if (c < 0) continue;
        struct timeval tv = { 2, 0 };
        setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        static char req[1 << 20];
        char buf[65536];
        size_t have = 0, want = (size_t)-1;
        for (;;) {
            ssize_t r = recv(c, buf, sizeof buf, 0);
            if (r <= 0) break;
            fwrite(buf, 1, (size_t)r, f);
            fflush(f);
            if (have + (size_t)r < sizeof req) memcpy(req + have, buf, (size_t)r);
            have += (size_t)r;
            req[have < sizeof req ? have : sizeof req - 1] = 0;
            /* one request: headers, then Content-Length bytes */
            char *end = strstr(req, "\r\n\r\n"), *cl = strcasestr(req, "Content-Length:");
            if (end && want == (size_t)-1) want = (size_t)(end + 4 - req) + (cl && cl < end ? strtoul(cl + 15, NULL, 10) : 0);
            if (have >= want) break;
        }
        const char *resp = "HTTP/1.1 500 Internal Server Error\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}";
        if (!strncmp(req, "GET /v1/models ", 15))
            resp = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 51\r\nConnection: close\r\n\r\n"
                   "{\"object\":\"list\",\"data\":[{\"id\":\"a\"},{\"id\":\"b\"}]}   ";
        else if (strstr(req, "Reply with OK."))
            resp = "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}";
        if (send(c, resp, strlen(resp), MSG_NOSIGNAL) < 0) {}
        close(c);
    }
}

/* Runs grade on subs with the capture as its router; exit status. */
static int ta_grade(int port, const char *out, const char *sub1, const char *sub2) {
    char url[64];
    snprintf(url, sizeof url, "http://127.0.0.1:%d", port);
    char *argv[] = { (char *)bin(), "grade", "--router", url, "--rubric", TA_DIR "/rubric.md", "--analysis-model", "a",
                     "--feedback-model", "b", "--out", (char *)out, "--retries", "0", "--quiet",
                     (char *)sub1, (char *)sub2, NULL };
    char log[256];
    snprintf(log, sizeof log, "%s.stdout", out);
    pid_t pid = spawn(argv, log);
    return wait_exit(pid, 30000);
}

static json_t *ta_rec(const char *out, const char *name) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s.json", out, name);
    return json_load_file(path, 0, NULL);
}

/* The entry of rec's "files" named path, or NULL. */
static json_t *ta_file(json_t *rec, const char *path) {
    json_t *a = json_object_get(rec, "files");
    for (size_t i = 0; i < json_array_size(a); i++)
        if (!strcmp(jstr(json_array_get(a, i), "path", NULL), path)) return json_array_get(a, i);
    return NULL;
}

/* ==== Attacks ==== */

static void test_links_in(int port) {
    const char *out = TA_DIR "/out";
    /* the class: a submission that is a link, a folder holding links */
    mkdir(TA_DIR "/class", 0755);
    mkdir(TA_DIR "/class/bob", 0755);
    mkdir(TA_DIR "/secretdir", 0755);
    write_text(TA_DIR "/secret.txt", TA_SECRET "\n");
    write_text(TA_DIR "/secretdir/id_rsa", TA_SECRET "-in-a-folder\n");
    write_text(TA_DIR "/class/bob/main.py", "print('bob was here')\n");
    CHECK(symlink("../secret.txt", TA_DIR "/class/alice.py") == 0, "link alice.py -> secret");
    CHECK(symlink("../../secret.txt", TA_DIR "/class/bob/x.py") == 0, "link bob/x.py -> secret");
    CHECK(symlink("../../secretdir", TA_DIR "/class/bob/keys") == 0, "link bob/keys -> a folder");
    int rc = ta_grade(port, out, TA_DIR "/class/alice.py", TA_DIR "/class/bob");
    CHECK(rc == 1, "grade exits 1 (nothing graded): %d", rc);
    char *cap = read_text(TA_DIR "/capture.bin");
    CHECK(cap && strstr(cap, "bob was here"), "the regular file of bob was sent (the capture saw the request)");
    CHECK(cap && !strstr(cap, TA_SECRET), "no byte of a link's target was sent");
    free(cap);
    json_t *a = ta_rec(out, "alice.py"), *b = ta_rec(out, "bob");
    const char *ae = jstr(a, "error", NULL);
    CHECK(a && strstr(ae, "skipped") && strstr(ae, "symbolic link"), "the linked submission is skipped: %s", ae);
    CHECK(!strcmp(jstr(ta_file(a, "alice.py"), "skipped", NULL), "symlink"), "alice.py listed as a skipped symlink");
    CHECK(!strcmp(jstr(ta_file(b, "x.py"), "skipped", NULL), "symlink"), "bob/x.py listed as a skipped symlink");
    CHECK(!strcmp(jstr(ta_file(b, "keys"), "skipped", NULL), "symlink"), "bob/keys listed as a skipped symlink");
    CHECK(ta_file(b, "keys/id_rsa") == NULL, "nothing under the linked folder listed");
    char *s = json_dumps(a, 0), *t = json_dumps(b, 0);
    CHECK(s && t && !strstr(s, TA_SECRET) && !strstr(t, TA_SECRET), "the records hold no secret");
    free(s);
    free(t);
    json_decref(a);
    json_decref(b);
}

static void test_links_out(int port) {
    /* feedback/ planted as a link to a folder elsewhere */
    const char *out = TA_DIR "/out2";
    mkdir(out, 0755);
    mkdir(TA_DIR "/elsewhere", 0755);
    CHECK(symlink("../elsewhere", TA_DIR "/out2/feedback") == 0, "link out2/feedback -> elsewhere");
    int rc = ta_grade(port, out, TA_DIR "/class/bob", TA_DIR "/class/bob");
    char *so = read_text(TA_DIR "/out2.stdout");
    CHECK(rc == 2 && so && strstr(so, "symbolic link"), "an output folder with a link is refused: exit %d, %s", rc, so ? so : "");
    free(so);
    struct stat st;
    CHECK(stat(TA_DIR "/out2/bob.json", &st) != 0, "no record written into the refused folder");
    CHECK(rmdir(TA_DIR "/elsewhere") == 0, "the link's target folder is still empty");
    /* a record's name planted as a link to a file of the grader */
    const char *out3 = TA_DIR "/out3";
    mkdir(out3, 0755);
    write_text(TA_DIR "/victim.txt", "keep me\n");
    CHECK(symlink("../victim.txt", TA_DIR "/out3/bob.json.tmp") == 0, "link out3/bob.json.tmp -> victim");
    rc = ta_grade(port, out3, TA_DIR "/class/bob", TA_DIR "/class/bob");
    char *v = read_text(TA_DIR "/victim.txt");
    CHECK(rc == 2 && v && !strcmp(v, "keep me\n"), "a planted record link: exit %d, the victim intact (%s)", rc, v ? v : "");
    free(v);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    mkdir("build", 0755);
    if (system("rm -rf " TA_DIR)) {}
    mkdir(TA_DIR, 0755);
    write_text(TA_DIR "/rubric.md", "# Lab\n## Correctness (5 points)\nWorks.\n");
    int port = 0, lfd = listen_loopback(&port, 0);
    CHECK(lfd >= 0, "capture listener");
    if (lfd < 0) return t_done("test_attack_grade");
    pid_t cap = ta_capture(lfd, TA_DIR "/capture.bin");
    close(lfd);
    test_links_in(port);
    test_links_out(port);
    kill(cap, SIGKILL);
    waitpid(cap, NULL, 0);
    return t_done("test_attack_grade");
}
