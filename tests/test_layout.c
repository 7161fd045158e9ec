/*
 * test_layout.c - the shape of the source tree, pinned: the rules
 * ../shared/DESIGN.md and issue 13 set for how the code is laid out, read
 * from the sources themselves so a change that breaks one fails CI.
 *
 *   - the product is modules, one per CMake library (the table `modules`
 *     below: base, kernels/math, kernels, kernels/cuda, modelfile,
 *     tokenizer, grammar, template, engine/model, engine/runtime,
 *     engine/scheduler, adapters, config, server, cli), each with the
 *     modules it declares it uses; every product file belongs to one, and
 *     the table has no cycle;
 *   - a file includes only headers of its own module and of the modules
 *     its module uses, directly or through them, so dependencies point one
 *     way: cli -> server -> adapters -> engine/scheduler -> engine/runtime
 *     -> engine/model -> tokenizer -> modelfile -> kernels -> base, with
 *     grammar/ (over tokenizer/) and template/ (over base/) beside the
 *     engine, and config/ reading only base/;
 *   - the include graph of the product folders has no cycle between
 *     folders, and none between files;
 *   - no object file of the module libraries uses a symbol of another
 *     that, directly or through others, uses one of its own (nm reads the
 *     libraries the build made): function-level layering;
 *   - an internal header (one under an internal/ folder) is included only
 *     from its own module (kernels/cuda also from kernels/internal, as its
 *     CMake include path has it);
 *   - no product .c function is over 150 lines, and no header of the
 *     engine's modules (modelfile, tokenizer, grammar, template, engine/)
 *     over 400 lines;
 *   - every product source and header opens with a comment.
 *
 * Functions are found the way the checked-in .clang-format lays them out:
 * a definition's body opens with "{" alone on a line at column 0 and closes
 * with "}" alone at column 0 (the clang_format test keeps that true).
 */
#include <criterion/criterion.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define MAX_FILES   512
#define MAX_INCLUDE 64
#define PATH_LEN    512

static const char *const product_roots[] = {"base",    "kernels",  "modelfile", "tokenizer",
                                            "grammar", "template", "engine",    "adapters",
                                            "config",  "server",   "cli"};

/*
 * The modules, one row per CMake library (CMakeLists.txt,
 * kernels/cuda/CMakeLists.txt), lowest first. uses: the modules it
 * declares (its target_link_libraries, and kernels/math for the libraries
 * that compute with it); a file may include headers of its own module and
 * of those, directly or through them, as CMake's PUBLIC links carry a
 * module's headers up. A file belongs to the row whose folder is the
 * longest prefix of its path (kernels/cuda/qt_cuda.cu is kernels/cuda's,
 * kernels/internal/ kernels'). internal_of: a module whose internal/
 * headers this one may include too. archive: the library the build makes,
 * under the build folder (NULL: header-only).
 */
typedef struct module {
    const char *folder;
    const char *uses; /* the folders of the modules it uses, space-separated */
    const char *internal_of;
    const char *archive;
} module;

static const module modules[] = {
    {"base", "", NULL, "libqlbase.a"},
    {"kernels/math", "", NULL, NULL},
    {"kernels", "base kernels/math", NULL, "libqlkernels.a"},
    {"kernels/cuda", "base kernels kernels/math", "kernels", "kernels/cuda/libqlkernels_cuda.a"},
    {"modelfile", "kernels", NULL, "libqlmodelfile.a"},
    {"tokenizer", "modelfile", NULL, "libqltokenizer.a"},
    {"grammar", "base tokenizer", NULL, "libqlgrammar.a"},
    {"template", "base", NULL, "libqltemplate.a"},
    {"engine/model", "modelfile tokenizer", NULL, "libqlmodel.a"},
    {"engine/runtime", "engine/model kernels/math kernels/cuda", NULL, "libqlruntime.a"},
    {"engine/scheduler", "engine/runtime grammar kernels/math", NULL, "libqlscheduler.a"},
    {"adapters", "engine/scheduler", NULL, "libqladapters.a"},
    {"config", "base", NULL, "libqlconfig.a"},
    {"server", "adapters engine/scheduler template config", NULL, "libqlserver.a"},
    {"cli", "server adapters engine/scheduler config", NULL, "libqlcli.a"},
};
#define N_MODULES ((int)(sizeof modules / sizeof *modules))

typedef struct src_file {
    char path[PATH_LEN];   /* relative to the source root */
    char folder[PATH_LEN]; /* its folder: the directory, internal/ stripped */
    int module;            /* its row in modules, -1 for none */
    int includes[MAX_INCLUDE];
    int n_includes;
    long lines;
} src_file;

static src_file files[MAX_FILES];
static int n_files;

/* Copy src into out (out_len bytes), refusing what does not fit. */
static void copy_path(char *out, size_t out_len, const char *src)
{
    size_t n = strlen(src);
    cr_assert_lt(n, out_len, "path too long: %s", src);
    memcpy(out, src, n + 1);
}

/* QL_SOURCE_DIR/rel opened for reading. */
static FILE *open_source(const char *rel)
{
    char abs[PATH_LEN * 2];
    int n = snprintf(abs, sizeof abs, "%s/%s", QL_SOURCE_DIR, rel);
    cr_assert(n > 0 && (size_t)n < sizeof abs, "path too long: %s", rel);
    FILE *in = fopen(abs, "r");
    cr_assert(in, "cannot open %s", abs);
    return in;
}

static bool has_suffix(const char *s, const char *suffix)
{
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && strcmp(s + n - k, suffix) == 0;
}

static bool is_source(const char *name)
{
    return has_suffix(name, ".c") || has_suffix(name, ".h") || has_suffix(name, ".cu");
}

static void module_folder(const char *path, char *out)
{
    copy_path(out, PATH_LEN, path);
    char *slash = strrchr(out, '/');
    if (slash)
        *slash = 0;
    size_t n = strlen(out);
    if (n >= 9 && strcmp(out + n - 9, "/internal") == 0)
        out[n - 9] = 0;
}

/* The row of modules whose folder is the longest prefix of path, -1 for
 * none. */
static int module_of(const char *path)
{
    int best = -1;
    size_t best_len = 0;
    for (int m = 0; m < N_MODULES; m++) {
        size_t n = strlen(modules[m].folder);
        if (n > best_len && strncmp(path, modules[m].folder, n) == 0 && path[n] == '/') {
            best = m;
            best_len = n;
        }
    }
    return best;
}

static int module_named(const char *folder)
{
    for (int m = 0; m < N_MODULES; m++)
        if (strcmp(modules[m].folder, folder) == 0)
            return m;
    return -1;
}

static void collect(const char *rel)
{
    char abs[PATH_LEN * 2];
    snprintf(abs, sizeof abs, "%s/%s", QL_SOURCE_DIR, rel);
    DIR *d = opendir(abs);
    cr_assert(d, "cannot open %s", abs);
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.')
            continue;
        char child[PATH_LEN];
        snprintf(child, sizeof child, "%s/%s", rel, e->d_name);
        char child_abs[PATH_LEN * 2];
        snprintf(child_abs, sizeof child_abs, "%s/%s", QL_SOURCE_DIR, child);
        struct stat st;
        if (stat(child_abs, &st) != 0)
            continue;
        if (S_ISDIR(st.st_mode)) {
            collect(child);
        } else if (is_source(e->d_name)) {
            cr_assert_lt(n_files, MAX_FILES);
            src_file *f = &files[n_files++];
            snprintf(f->path, sizeof f->path, "%s", child);
            module_folder(child, f->folder);
            f->module = module_of(child);
        }
    }
    closedir(d);
}

static int find_file(const char *path)
{
    for (int i = 0; i < n_files; i++)
        if (strcmp(files[i].path, path) == 0)
            return i;
    return -1;
}

/* "a/b/../c.h" -> "a/c.h", in place. */
static void normalize(char *path)
{
    char *dots;
    while ((dots = strstr(path, "/../"))) {
        char *start = dots;
        while (start > path && start[-1] != '/')
            start--;
        memmove(start, dots + 4, strlen(dots + 4) + 1);
    }
}

/*
 * The product file an `#include "name"` in f means: the compiler looks
 * beside f first, then along the include path; a product header's name is
 * unique, so the path is tried under every product folder. -1 for a
 * header from outside (llhttp, the CUDA toolkit, the emulator).
 */
static int resolve(const src_file *f, const char *name)
{
    char dir[PATH_LEN], try[PATH_LEN * 2];
    snprintf(dir, sizeof dir, "%s", f->path);
    *strrchr(dir, '/') = 0;
    snprintf(try, sizeof try, "%s/%s", dir, name);
    normalize(try);
    int k = find_file(try);
    if (k >= 0)
        return k;
    for (int i = 0; i < n_files; i++) {
        size_t n = strlen(files[i].path), m = strlen(name);
        if (n > m && files[i].path[n - m - 1] == '/' && strcmp(files[i].path + n - m, name) == 0)
            return i;
    }
    return -1;
}

static void scan(src_file *f)
{
    FILE *in = open_source(f->path);
    char line[4096];
    while (fgets(line, sizeof line, in)) {
        f->lines++;
        const char *p = line;
        while (*p == ' ' || *p == '\t')
            p++;
        if (strncmp(p, "#include \"", 10) != 0)
            continue;
        char name[PATH_LEN];
        const char *end = strchr(p + 10, '"');
        if (!end || (size_t)(end - p - 10) >= sizeof name)
            continue;
        memcpy(name, p + 10, (size_t)(end - p - 10));
        name[end - p - 10] = 0;
        int k = resolve(f, name);
        if (k >= 0 && f->n_includes < MAX_INCLUDE)
            f->includes[f->n_includes++] = k;
    }
    fclose(in);
}

static void load_tree(void)
{
    if (n_files)
        return;
    for (size_t i = 0; i < sizeof product_roots / sizeof *product_roots; i++)
        collect(product_roots[i]);
    for (int i = 0; i < n_files; i++)
        scan(&files[i]);
}

/* --- cycles --------------------------------------------------------------- */

enum { WHITE, GREY, BLACK };

/* Depth-first search over n nodes with edge(a, b); on a cycle, its path
 * (names via name_of) goes into why and true is returned. */
typedef struct graph {
    int n;
    bool (*edge)(int a, int b);
    const char *(*name_of)(int v);
    int color[MAX_FILES];
    int stack[MAX_FILES];
    int depth;
} graph;

static bool dfs(graph *g, int v, char *why, size_t why_len)
{
    g->color[v] = GREY;
    g->stack[g->depth++] = v;
    for (int w = 0; w < g->n; w++) {
        if (w == v || !g->edge(v, w))
            continue;
        if (g->color[w] == GREY) {
            size_t used = 0;
            int from = 0;
            while (g->stack[from] != w)
                from++;
            for (int i = from; i < g->depth && used < why_len; i++)
                used +=
                    (size_t)snprintf(why + used, why_len - used, "%s -> ", g->name_of(g->stack[i]));
            if (used < why_len)
                snprintf(why + used, why_len - used, "%s", g->name_of(w));
            return true;
        }
        if (g->color[w] == WHITE && dfs(g, w, why, why_len))
            return true;
    }
    g->depth--;
    g->color[v] = BLACK;
    return false;
}

static bool find_cycle(graph *g, char *why, size_t why_len)
{
    memset(g->color, 0, sizeof g->color);
    for (int v = 0; v < g->n; v++) {
        g->depth = 0;
        if (g->color[v] == WHITE && dfs(g, v, why, why_len))
            return true;
    }
    return false;
}

/* Fails the test, naming the cycle after what, when the graph of n nodes
 * with edge(a, b) has one. */
static void assert_no_cycle(int n, bool (*edge)(int a, int b), const char *(*name_of)(int v),
                            const char *what)
{
    static graph g;
    g.n = n;
    g.edge = edge;
    g.name_of = name_of;
    char why[2048] = "";
    cr_assert_not(find_cycle(&g, why, sizeof why), "%s: %s", what, why);
}

static bool file_edge(int a, int b)
{
    for (int i = 0; i < files[a].n_includes; i++)
        if (files[a].includes[i] == b)
            return true;
    return false;
}

static const char *file_name(int v)
{
    return files[v].path;
}

static char folders[MAX_FILES][PATH_LEN];
static int n_folders;

static int folder_index(const char *folder)
{
    for (int i = 0; i < n_folders; i++)
        if (strcmp(folders[i], folder) == 0)
            return i;
    snprintf(folders[n_folders], PATH_LEN, "%s", folder);
    return n_folders++;
}

static bool folder_edge(int a, int b)
{
    for (int i = 0; i < n_files; i++) {
        if (strcmp(files[i].folder, folders[a]) != 0)
            continue;
        for (int k = 0; k < files[i].n_includes; k++)
            if (strcmp(files[files[i].includes[k]].folder, folders[b]) == 0)
                return true;
    }
    return false;
}

static const char *folder_name(int v)
{
    return folders[v];
}

Test(layout, no_include_cycle_between_files)
{
    load_tree();
    assert_no_cycle(n_files, file_edge, file_name, "include cycle");
}

Test(layout, no_include_cycle_between_folders)
{
    load_tree();
    for (int i = 0; i < n_files; i++)
        folder_index(files[i].folder);
    assert_no_cycle(n_folders, folder_edge, folder_name, "folders include each other");
}

/* --- references between object files ------------------------------------ */

/*
 * Function-level layering: which object file of the product libraries
 * uses a symbol another defines, read with binutils' nm from the libraries
 * this test links against (QL_BINARY_DIR). A call, a function pointer
 * stored in a table and a read of another file's data all count: each is a
 * dependency of one file on another, and none may be circular, so a lower
 * layer reaches a higher one only through a callback it is handed.
 */
#define MAX_OBJECTS 256
#define MAX_SYMBOLS 8192

static char objects[MAX_OBJECTS][128];
static int n_objects;
static bool object_uses[MAX_OBJECTS][MAX_OBJECTS];
static struct {
    char name[256]; /* longer names (C++'s mangled ones) are cut, alike on both sides */
    int object;
} defined[MAX_SYMBOLS];
static int n_defined;

static int object_index(const char *name)
{
    for (int i = 0; i < n_objects; i++)
        if (strcmp(objects[i], name) == 0)
            return i;
    cr_assert_lt(n_objects, MAX_OBJECTS);
    copy_path(objects[n_objects], sizeof objects[0], name);
    return n_objects++;
}

/* Run nm over one library, calling fn(object, kind, symbol) per line. */
static void each_symbol(const char *library, const char *flags,
                        void (*fn)(int object, char kind, const char *symbol))
{
    char path[PATH_LEN * 2], command[PATH_LEN * 3];
    int n = snprintf(path, sizeof path, "%s/%s", QL_BINARY_DIR, library);
    cr_assert(n > 0 && (size_t)n < sizeof path);
    FILE *probe = fopen(path, "r");
    /* kernels/cuda only exists in a CUDA build; any other library of the
     * table the build did not make is a table that has gone stale */
    cr_assert(probe || strncmp(library, "kernels/cuda/", 13) == 0,
              "%s is missing: the table of modules names a library the build does not make", path);
    if (!probe)
        return;
    fclose(probe);
    n = snprintf(command, sizeof command, "nm -A %s '%s' 2>/dev/null", flags, path);
    cr_assert(n > 0 && (size_t)n < sizeof command);
    FILE *nm = popen(command, "r");
    cr_assert(nm, "cannot run nm");
    char line[4096];
    while (fgets(line, sizeof line, nm)) {
        /* "<library>:<member>:<address> T name" or "<library>:<member>: U name" */
        char *member = strchr(line + strlen(path), ':');
        if (!member)
            continue;
        member++;
        char *colon = strchr(member, ':');
        if (!colon)
            continue;
        *colon = 0;
        char kind, symbol[256];
        if (sscanf(colon + 1, "%*[0-9a-f ] %c %255s", &kind, symbol) != 2 &&
            sscanf(colon + 1, " %c %255s", &kind, symbol) != 2)
            continue;
        /* named with its library: two modules may each have a serve.c */
        char object[160];
        n = snprintf(object, sizeof object, "%s(%s)", library, member);
        cr_assert(n > 0 && (size_t)n < sizeof object);
        fn(object_index(object), kind, symbol);
    }
    pclose(nm);
}

static void record_definition(int object, char kind, const char *symbol)
{
    (void)kind;
    cr_assert_lt(n_defined, MAX_SYMBOLS);
    /* symbol holds at most 255 bytes (each_symbol's scan) */
    copy_path(defined[n_defined].name, sizeof defined[0].name, symbol);
    defined[n_defined++].object = object;
}

static void record_use(int object, char kind, const char *symbol)
{
    if (kind != 'U')
        return;
    for (int i = 0; i < n_defined; i++)
        if (strcmp(defined[i].name, symbol) == 0 && defined[i].object != object)
            object_uses[object][defined[i].object] = true;
}

static bool object_edge(int a, int b)
{
    return object_uses[a][b];
}

static const char *object_name(int v)
{
    return objects[v];
}

Test(layout, no_reference_cycle_between_object_files)
{
    for (int m = 0; m < N_MODULES; m++)
        if (modules[m].archive)
            each_symbol(modules[m].archive, "-g --defined-only", record_definition);
    for (int m = 0; m < N_MODULES; m++)
        if (modules[m].archive)
            each_symbol(modules[m].archive, "-u", record_use);
    /* the reading itself: the product has dozens of objects using each other */
    int n_edges = 0;
    for (int a = 0; a < n_objects; a++)
        for (int b = 0; b < n_objects; b++)
            n_edges += object_uses[a][b];
    cr_assert_geq(n_objects, 40, "only %d object files read from %s", n_objects, QL_BINARY_DIR);
    cr_assert_geq(n_edges, n_objects, "only %d references between object files", n_edges);
    assert_no_cycle(n_objects, object_edge, object_name, "object files use each other");
}

/* --- the order between modules ------------------------------------------ */

/* uses[a][b]: module a declares module b in its row */
static bool module_uses[N_MODULES][N_MODULES];
/* depends[a][b]: a uses b, directly or through others */
static bool module_depends[N_MODULES][N_MODULES];

static void read_module_table(void)
{
    static bool done;
    if (done)
        return;
    done = true;
    for (int a = 0; a < N_MODULES; a++) {
        char uses[PATH_LEN];
        copy_path(uses, sizeof uses, modules[a].uses);
        for (char *save = NULL, *w = strtok_r(uses, " ", &save); w;
             w = strtok_r(NULL, " ", &save)) {
            int b = module_named(w);
            cr_assert_geq(b, 0, "the row of %s/ uses %s/, which is no module of the table",
                          modules[a].folder, w);
            module_uses[a][b] = module_depends[a][b] = true;
        }
    }
    /* the closure (Warshall): a depends on c when it depends on some b
     * that depends on c */
    for (int b = 0; b < N_MODULES; b++)
        for (int a = 0; a < N_MODULES; a++)
            for (int c = 0; c < N_MODULES; c++)
                if (module_depends[a][b] && module_depends[b][c])
                    module_depends[a][c] = true;
}

static bool module_edge(int a, int b)
{
    return module_uses[a][b];
}

static const char *module_name(int v)
{
    return modules[v].folder;
}

Test(layout, the_table_of_modules_has_no_cycle)
{
    read_module_table();
    assert_no_cycle(N_MODULES, module_edge, module_name, "modules use each other");
}

Test(layout, every_product_file_belongs_to_a_module_and_every_module_has_files)
{
    load_tree();
    int n_in[N_MODULES] = {0};
    for (int i = 0; i < n_files; i++) {
        cr_assert_geq(files[i].module, 0, "%s is in no module of the table", files[i].path);
        n_in[files[i].module]++;
    }
    for (int m = 0; m < N_MODULES; m++)
        cr_assert_gt(n_in[m], 0, "the table's module %s/ has no file", modules[m].folder);
}

Test(layout, dependencies_point_one_way)
{
    load_tree();
    read_module_table();
    for (int i = 0; i < n_files; i++) {
        int from = files[i].module;
        for (int k = 0; k < files[i].n_includes; k++) {
            const src_file *h = &files[files[i].includes[k]];
            cr_assert(from == h->module || module_depends[from][h->module],
                      "%s includes %s: %s/ does not use %s/ (tests/test_layout.c's table of "
                      "modules, as CMakeLists.txt declares them)",
                      files[i].path, h->path, modules[from].folder, modules[h->module].folder);
        }
    }
}

Test(layout, internal_headers_stay_in_their_module)
{
    load_tree();
    for (int i = 0; i < n_files; i++) {
        for (int k = 0; k < files[i].n_includes; k++) {
            const src_file *h = &files[files[i].includes[k]];
            if (!strstr(h->path, "/internal/"))
                continue;
            /* its own module, or one whose row names it as internal_of
             * (kernels/cuda for kernels/internal) */
            const char *also = modules[files[i].module].internal_of;
            bool inside = files[i].module == h->module ||
                          (also && strcmp(also, modules[h->module].folder) == 0);
            cr_assert(inside, "%s includes %s, internal to %s/", files[i].path, h->path,
                      modules[h->module].folder);
        }
    }
}

Test(layout, no_product_function_over_150_lines)
{
    load_tree();
    for (int i = 0; i < n_files; i++) {
        /* the limit is on .c functions; CUDA kernels (.cu) are
         * left whole where splitting them would move registers and
         * shared memory around untested on a device */
        if (!has_suffix(files[i].path, ".c"))
            continue;
        FILE *in = open_source(files[i].path);
        char line[4096], previous[4096] = "";
        long number = 0, opened = 0;
        char signature[4096] = "";
        while (fgets(line, sizeof line, in)) {
            number++;
            if (strcmp(line, "{\n") == 0) {
                opened = number;
                snprintf(signature, sizeof signature, "%s", previous);
            } else if (strcmp(line, "}\n") == 0 && opened) {
                /* the body and the line of the signature before it */
                long length = number - opened + 2;
                cr_expect_leq(length, 150, "%s:%ld: a function of %ld lines: %s", files[i].path,
                              opened, length, signature);
                opened = 0;
            }
            snprintf(previous, sizeof previous, "%s", line);
        }
        fclose(in);
    }
}

/* The engine's modules: what was engine/ before issue 31 moved modelfile/,
 * tokenizer/, grammar/ and template/ beside it, and engine/ itself. */
static bool in_engine_module(const char *path)
{
    static const char *const engine_folders[] = {"modelfile/", "tokenizer/", "grammar/",
                                                 "template/", "engine/"};
    for (size_t i = 0; i < sizeof engine_folders / sizeof *engine_folders; i++)
        if (strncmp(path, engine_folders[i], strlen(engine_folders[i])) == 0)
            return true;
    return false;
}

Test(layout, no_engine_header_over_400_lines)
{
    load_tree();
    int n_headers = 0;
    for (int i = 0; i < n_files; i++)
        if (in_engine_module(files[i].path) && has_suffix(files[i].path, ".h")) {
            n_headers++;
            cr_expect_leq(files[i].lines, 400, "%s has %ld lines", files[i].path, files[i].lines);
        }
    /* the public and internal headers of the seven modules, at least */
    cr_assert_geq(n_headers, 11, "only %d engine headers found", n_headers);
}

Test(layout, every_product_file_opens_with_a_comment)
{
    load_tree();
    for (int i = 0; i < n_files; i++) {
        FILE *in = open_source(files[i].path);
        char line[4096] = "";
        cr_assert(fgets(line, sizeof line, in));
        fclose(in);
        cr_expect(strncmp(line, "/*", 2) == 0 || strncmp(line, "//", 2) == 0,
                  "%s does not open with a comment saying what it is for", files[i].path);
    }
}

/* The checks themselves: the cycle search finds a cycle that is there, so
 * the tests above cannot pass by finding nothing. */
static bool ring_edge(int a, int b)
{
    return b == (a + 1) % 3;
}
static const char *ring_name(int v)
{
    static const char *const names[] = {"a.h", "b.h", "c.h"};
    return names[v];
}

Test(layout, the_cycle_search_finds_a_planted_cycle)
{
    static graph g;
    g.n = 3;
    g.edge = ring_edge;
    g.name_of = ring_name;
    char why[256] = "";
    cr_assert(find_cycle(&g, why, sizeof why));
    cr_assert_str_eq(why, "a.h -> b.h -> c.h -> a.h");
}

Test(layout, the_tree_was_read)
{
    load_tree();
    /* a few files every layout of qlserve has; if the walk missed them the
     * other checks would pass vacuously */
    cr_assert_geq(n_files, 50, "only %d product files found under %s", n_files, QL_SOURCE_DIR);
    cr_assert_geq(find_file("base/ql_base.h"), 0);
    cr_assert_geq(find_file("kernels/qtensor.h"), 0);
    int n_edges = 0;
    for (int i = 0; i < n_files; i++)
        n_edges += files[i].n_includes;
    cr_assert_geq(n_edges, n_files, "only %d includes resolved", n_edges);
}

/*
 * kernels/cuda chooses by quant kind only through its table (issue 31):
 * outside qt_cuda_kinds.c no `switch` on an expression that names a kind
 * and no `case QT_<kind>:` label, so a new kind is a row there, not a hunt
 * through the .cu files.
 */
Test(layout, kernels_cuda_chooses_by_kind_only_in_its_table)
{
    load_tree();
    int n_read = 0;
    for (int i = 0; i < n_files; i++) {
        const char *path = files[i].path;
        if (strncmp(path, "kernels/cuda/", strlen("kernels/cuda/")) != 0 ||
            strcmp(path, "kernels/cuda/qt_cuda_kinds.c") == 0)
            continue;
        n_read++;
        FILE *in = open_source(path);
        char line[1024];
        for (int no = 1; fgets(line, sizeof line, in); no++) {
            char expr[1024] = "";
            const char *sw = strstr(line, "switch (");
            if (sw)
                sscanf(sw + strlen("switch ("), "%1023[^)]", expr);
            cr_expect_null(strstr(expr, "kind"), "%s:%d switches on a kind: %s", path, no, line);
            const char *label = strstr(line, "case QT_");
            cr_expect(!label || strncmp(label, "case QT_CUDA_", strlen("case QT_CUDA_")) == 0,
                      "%s:%d has a case for a kind: %s", path, no, line);
        }
        fclose(in);
    }
    /* the walk found kernels/cuda (else the check passes vacuously) */
    cr_assert_geq(n_read, 8, "only %d files of kernels/cuda read", n_read);
}
