/* test_smollm2.c - the real SmolLM2-135M-Instruct Q4_1 model (tools/models.sh).
 *
 *   - its tokenizer (pre-tokenizer "smollm": every digit a piece, GPT-2's
 *     split between them) against mainline llama.cpp's ids for strings that
 *     tell the pre-tokenizers apart (tests/data/oracle/smollm2-tokenize.jsonl,
 *     written by make_smollm2_goldens.py beside it), and decoding back;
 *   - its chat template: tandem's ChatML rendering (with SmolLM2's default
 *     system turn) byte for byte against the template itself rendered by
 *     Jinja2 (tests/render_chat.py);
 *   - the model loads (Q4_1 weights, a Q8_0 tied output) and answers a chat
 *     question greedily with the fact it knows.
 * The logits themselves are test_golden's (tests/data/oracle/smollm2-Q4_1.jsonl).
 * Without the model: "skipped: smollm2: ..." (a failure where TANDEM_REQUIRE
 * names smollm2). */
#include "t.h"

#include <jansson.h>
#include <sys/stat.h>

#include "engine/generate.h"
#include "engine/model.h"
#include "api/tools.h"

#define TS_DIR "build/test_smollm2.d"
#define TS_TOKENIZE "tests/data/oracle/smollm2-tokenize.jsonl"

/* ==== Tokenizer against the oracle ==== */

static void test_tokenize(const tokenizer *tok) {
    FILE *f = fopen(TS_TOKENIZE, "r");
    CHECK(f != NULL, "open %s", TS_TOKENIZE);
    if (!f) return;
    char *line = NULL;
    size_t cap = 0;
    int n_lines = 0, digit_lines = 0;
    while (getline(&line, &cap, f) > 0) {
        json_error_t je;
        json_t *o = json_loads(line, 0, &je);
        CHECK(o != NULL, "%s: bad JSON: %s", TS_TOKENIZE, je.text);
        if (!o) break;
        const char *text = json_string_value(json_object_get(o, "text"));
        json_t *ids = json_object_get(o, "ids");
        size_t len = strlen(text), nw = json_array_size(ids);
        int32_t got[512];
        int64_t n = tokenizer_encode(tok, text, len, 1, 1, got, 512);
        int same = n == (int64_t)nw;
        for (size_t i = 0; same && i < nw; i++) same = got[i] == json_integer_value(json_array_get(ids, i));
        int k = 0;
        while (k < n && k < (int)nw && got[k] == json_integer_value(json_array_get(ids, (size_t)k))) k++;
        CHECK(same, "tokenize \"%s\": %lld tokens, the oracle %zu (first differing id at %d)", text, (long long)n, nw, k);
        /* decoding gives the text back (no BOS is added: add_bos is false) */
        char back[4096];
        size_t nb = 0;
        for (int64_t i = 0; i < n && i < 512; i++) {
            int k = tokenizer_token_bytes(tok, got[i], 1, back + nb, sizeof back - nb);
            if (k < 0) break;
            nb += (size_t)k;
        }
        CHECK(nb == len && !memcmp(back, text, len), "decode of \"%s\" gives it back", text);
        digit_lines += strpbrk(text, "0123456789") != NULL;
        n_lines++;
        json_decref(o);
    }
    free(line);
    fclose(f);
    CHECK(n_lines >= 10 && digit_lines >= 4, "%d oracle strings, %d with digits", n_lines, digit_lines);
    /* the fact that sets "smollm" apart from plain GPT-2: a space before a
     * digit is a piece of its own, and so is each digit */
    int32_t a[16], b[16];
    int64_t na = tokenizer_encode(tok, " 42", 3, 0, 0, a, 16), nb = tokenizer_encode(tok, " ", 1, 0, 0, b, 16);
    int64_t n4 = tokenizer_encode(tok, "4", 1, 0, 0, b + 1, 15), n2 = tokenizer_encode(tok, "2", 1, 0, 0, b + 2, 14);
    CHECK(na == 3 && nb == 1 && n4 == 1 && n2 == 1 && a[0] == b[0] && a[1] == b[1] && a[2] == b[2],
          "\" 42\" is \" \", \"4\", \"2\" (%lld tokens)", (long long)na);
}

/* ==== Chat template against Jinja2 ==== */

static char *ts_read_all(FILE *f) {
    size_t n = 0, cap = 4096, k;
    char *s = malloc(cap);
    while (s && (k = fread(s + n, 1, cap - n - 1, f)) > 0) {
        n += k;
        if (n + 1 >= cap) { char *t = realloc(s, cap *= 2); if (!t) { free(s); return NULL; } s = t; }
    }
    if (s) s[n] = 0;
    return s;
}

static void test_chat(const gguf_file *g) {
    char err[256];
    chat_style st;
    CHECK(tools_style_detect(g, &st, err, sizeof err) == 0 && st.fmt == CHAT_CHATML && !st.qwen_default_system &&
          st.default_system && strstr(st.default_system, "SmolLM"), "SmolLM2's style: ChatML with its default system turn");
    gguf_str tpl;
    if (gguf_get_str(g, "tokenizer.chat_template", &tpl) != 0) { CHECK(0, "no chat template"); return; }
    mkdir("build", 0755);
    mkdir(TS_DIR, 0755);
    FILE *f = fopen(TS_DIR "/smollm2.jinja", "w");
    CHECK(f != NULL, "write " TS_DIR "/smollm2.jinja");
    if (!f) return;
    fwrite(tpl.ptr, 1, tpl.len, f);
    fclose(f);
    static const char *const convs[] = {
        "{\"messages\":[{\"role\":\"user\",\"content\":\"What is the capital of France?\"}]}",
        "{\"messages\":[{\"role\":\"system\",\"content\":\"Be brief.\"},{\"role\":\"user\",\"content\":\"Hi there\"}]}",
        /* one string on two lines, in parentheses: clang's -Wstring-concatenation
         * otherwise takes it for a missing comma */
        ("{\"messages\":[{\"role\":\"user\",\"content\":\"2+2?\"},{\"role\":\"assistant\",\"content\":\"4\"},"
         "{\"role\":\"user\",\"content\":\" and  3+3? \\n\"}]}"),
    };
    for (size_t i = 0; i < sizeof convs / sizeof convs[0]; i++) {
        f = fopen(TS_DIR "/conv.json", "w");
        if (!f) { CHECK(0, "write conv.json"); return; }
        fputs(convs[i], f);
        fclose(f);
        FILE *p = popen("python3 tests/render_chat.py " TS_DIR "/smollm2.jinja " TS_DIR "/conv.json", "r");
        char *want = p ? ts_read_all(p) : NULL;
        int rc = p ? pclose(p) : -1;
        if (rc != -1 && WEXITSTATUS(rc) == 3) {
            free(want);
            t_skip_what("jinja2", "python3 has no jinja2: SmolLM2's template not rendered by its own Jinja");
            return;
        }
        json_t *conv = json_loads(convs[i], 0, NULL);
        char *got = tools_render(&st, json_object_get(conv, "messages"), NULL, NULL, err, sizeof err);
        CHECK(rc == 0 && want && got && !strcmp(want, got), "conversation %zu: tandem\n---\n%s\n---\nJinja2\n---\n%s\n---",
              i, got ? got : err, want ? want : "(failed)");
        free(want);
        free(got);
        json_decref(conv);
    }
}

/* ==== The model ==== */

typedef struct { char text[2048]; size_t n; tok_stream ts; } ts_out;

static int ts_collect(void *ud, int32_t id) {
    ts_out *o = ud;
    int k = tok_stream_push(&o->ts, id, o->text + o->n, sizeof o->text - 1 - o->n);
    if (k > 0) o->n += (size_t)k;
    return 0;
}

static void test_model(const char *path) {
    char err[512];
    model *m = NULL;
    model_opts mo = { .n_threads = 2, .n_batch = 512 };
    CHECK(model_load(&m, path, &mo, err, sizeof err) == 0, "load %s: %s", path, err);
    if (!m) return;
    const gguf_file *g = model_get_gguf(m);
    const gguf_tensor *q = gguf_find_tensor(g, "blk.0.attn_q.weight"), *e = gguf_find_tensor(g, "token_embd.weight");
    CHECK(q && q->type == GGML_TYPE_Q4_1 && e && e->type == GGML_TYPE_Q8_0 && !gguf_find_tensor(g, "output.weight"),
          "Q4_1 weights, a Q8_0 embedding that is also the output");
    test_tokenize(model_get_tokenizer(m));
    test_chat(g);

    /* a chat question, greedy: the answer names the capital */
    chat_style st;
    json_t *msgs = json_loads("[{\"role\":\"user\",\"content\":\"What is the capital of France? Answer in one sentence.\"}]",
                              0, NULL);
    char *prompt = tools_style_detect(g, &st, err, sizeof err) ? NULL : tools_render(&st, msgs, NULL, NULL, err, sizeof err);
    json_decref(msgs);
    CHECK(prompt != NULL, "render: %s", err);
    int n_ids = 0;
    int32_t *ids = prompt ? tools_tokenize_prompt(m, prompt, 0, &n_ids, err, sizeof err) : NULL;
    free(prompt);
    CHECK(ids && n_ids > 30, "prompt with the default system turn: %d tokens", n_ids);
    /* the one-user-message form ("prompt" + "chat", tandem run --chat) renders the same */
    int n_one = 0;
    int32_t *one = tools_tokenize_prompt(m, "What is the capital of France? Answer in one sentence.", 1, &n_one, err, sizeof err);
    CHECK(one && ids && n_one == n_ids && !memcmp(one, ids, sizeof(int32_t) * (size_t)n_ids),
          "a single chat prompt gets the default system turn too (%d vs %d tokens)", n_one, n_ids);
    free(one);
    session *s = NULL;
    CHECK(session_new(&s, m, 512, GGML_TYPE_F16, err, sizeof err) == 0, "session: %s", err);
    const model_hparams *hp = model_get_hparams(m);
    float *logits = malloc(sizeof(float) * (size_t)hp->n_vocab);
    if (ids && s && logits) {
        sampler_params sp = sampler_defaults();
        sp.temp = 0;
        sampler *smp = sampler_new(&sp, hp->n_vocab);
        static ts_out out;
        memset(&out, 0, sizeof out);
        tok_stream_init(&out.ts, model_get_tokenizer(m));
        gen_opts go = { .max_tokens = 24, .on_token = ts_collect, .ud = &out };
        gen_stats gs;
        CHECK(generate_run(m, s, smp, ids, n_ids, logits, 0, &go, &gs, err, sizeof err) == 0, "generate: %s", err);
        int k = tok_stream_flush(&out.ts, out.text + out.n, sizeof out.text - 1 - out.n);
        if (k > 0) out.n += (size_t)k;
        out.text[out.n] = 0;
        printf("  SmolLM2 answers: %s\n", out.text);
        CHECK(strstr(out.text, "Paris") != NULL, "the answer names Paris: \"%s\"", out.text);
        sampler_free(smp);
    }
    free(logits);
    free(ids);
    session_free(s);
    model_free(m);
}

int main(void) {
    char path[1024];
    if (t_smollm2(path, sizeof path)) test_model(path);
    return t_done("test_smollm2");
}
