/* cache.c - `tandem cache save|load`: an operator's form of a decode node's
 * POST /v1/cache/save and /v1/cache/load (node_decode.h, kvstore.h), signed
 * with the cluster's secret like the router's requests. A class's rubric
 * can so be computed and written to disk once, and loaded into memory on
 * every decode node that shares (or was given a copy of) its directory
 * before grading starts. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <curl/curl.h>
#include <jansson.h>

#include "base/cliopt.h"
#include "base/strbuf.h"
#include "cmd/cli.h"
#include "net/node_auth.h"

#define CACHE_CMD "tandem cache"
#define CACHE_MAX_PROMPT (8u << 20)     /* the node's default --max-body-bytes */
#define CACHE_TIMEOUT_MS 600000L        /* a save may compute a long prompt on a slow node */

static void cache_usage(FILE *f) {
    fprintf(f,
        "usage: tandem cache save|load --node HOST:PORT (-p TEXT | -f FILE) [options]\n"
        "  save: the node computes the prompt if its KV store lacks it and writes its\n"
        "        64-token blocks to its --kv-cache-dir; load: reads them into memory\n"
        "  --node HOST:PORT    the decode node\n"
        "  -p TEXT | -f FILE   the prefix (a rubric), as the text the requests start with\n"
        "  --chat              wrap it as one user message with the model's chat template\n"
        "  --secret-file F     the cluster's shared secret (or env TANDEM_SECRET)\n");
}

static size_t cache_sink(char *p, size_t sz, size_t nm, void *ud) {
    return strbuf_put(ud, p, sz * nm) ? 0 : sz * nm;
}

int cli_cache(int argc, char **argv) {
    if (cliopt_wants_help(argc, argv)) { cache_usage(stdout); return CLI_EXIT_OK; }
    if (argc < 1 || (strcmp(argv[0], "save") && strcmp(argv[0], "load"))) { cache_usage(stderr); return CLI_EXIT_USAGE; }
    const char *what = argv[0], *node = NULL, *text = NULL, *file = NULL, *secret_file = NULL;
    int chat = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int bad;
        if (!strcmp(a, "--chat")) { chat = 1; continue; }
        if (!strcmp(a, "--node")) bad = cliopt_str(CACHE_CMD, a, v, &node);
        else if (!strcmp(a, "-p")) bad = cliopt_str(CACHE_CMD, a, v, &text);
        else if (!strcmp(a, "-f")) bad = cliopt_str(CACHE_CMD, a, v, &file);
        else if (!strcmp(a, "--secret-file")) bad = cliopt_str(CACHE_CMD, a, v, &secret_file);
        else { fprintf(stderr, CACHE_CMD ": unknown option %s\n", a); cache_usage(stderr); return CLI_EXIT_USAGE; }
        if (bad) return CLI_EXIT_USAGE;
        i++;
    }
    if (!node || !!text == !!file) {
        fprintf(stderr, CACHE_CMD ": give --node and one of -p, -f\n");
        return CLI_EXIT_USAGE;
    }
    char err[512], *prompt = NULL;
    if (file) {
        FILE *f = fopen(file, "rb");
        strbuf b = { 0 };
        char buf[65536];
        size_t k;
        while (f && (k = fread(buf, 1, sizeof buf, f)) > 0 && b.len <= CACHE_MAX_PROMPT) strbuf_put(&b, buf, k);
        if (!f || b.len > CACHE_MAX_PROMPT) {
            fprintf(stderr, CACHE_CMD ": %s: %s\n", file, f ? "larger than 8 MiB" : "cannot read");
            if (f) fclose(f);
            free(b.p);
            return CLI_EXIT_FAIL;
        }
        fclose(f);
        prompt = b.p ? b.p : strdup("");
    } else prompt = strdup(text);
    char *secret = NULL;
    size_t slen = 0;
    node_auth_key key;
    int have_key = 0;
    if (secret_file || getenv("TANDEM_SECRET")) {
        if (cliopt_load_secret(secret_file, &secret, &slen, err, sizeof err)) {
            fprintf(stderr, CACHE_CMD ": %s\n", err);
            free(prompt);
            return CLI_EXIT_USAGE;
        }
        node_auth_derive(&key, secret, slen, NODE_AUTH_LABEL_DECODE_API);
        have_key = 1;
        memset(secret, 0, slen);
        free(secret);
    }
    json_t *o = json_pack("{s:s, s:b}", "prompt", prompt ? prompt : "", "chat", chat);
    free(prompt);
    char *body = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    char path[32], url[600];
    snprintf(path, sizeof path, "/v1/cache/%s", what);
    snprintf(url, sizeof url, "http://%s%s", node, path);
    strbuf resp = { 0 };
    long status = 0;
    CURL *h = body ? curl_easy_init() : NULL;
    struct curl_slist *hl = curl_slist_append(NULL, "Content-Type: application/json");
    if (hl && have_key) hl = node_auth_curl_sign(hl, &key, "POST", path, body, strlen(body));
    int rc = CLI_EXIT_FAIL;
    if (h && hl) {
        curl_easy_setopt(h, CURLOPT_URL, url);
        curl_easy_setopt(h, CURLOPT_POSTFIELDS, body);
        curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE, (long)strlen(body));
        curl_easy_setopt(h, CURLOPT_HTTPHEADER, hl);
        curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, cache_sink);
        curl_easy_setopt(h, CURLOPT_WRITEDATA, &resp);
        curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
        curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, CACHE_TIMEOUT_MS);
        CURLcode cr = curl_easy_perform(h);
        curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &status);
        if (cr != CURLE_OK) fprintf(stderr, CACHE_CMD ": %s: %s\n", url, curl_easy_strerror(cr));
        else if (status != 200) fprintf(stderr, CACHE_CMD ": %s: HTTP %ld: %.*s\n", url, status, (int)resp.len, resp.p ? resp.p : "");
        else {
            printf("%.*s\n", (int)resp.len, resp.p ? resp.p : "");
            rc = CLI_EXIT_OK;
        }
    }
    curl_slist_free_all(hl);
    if (h) curl_easy_cleanup(h);
    free(body);
    free(resp.p);
    if (have_key) node_auth_wipe(&key);
    return rc;
}
